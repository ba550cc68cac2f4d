from shardconsole.cli import entry

entry()
