from shardconsole.cli.main import entry

entry()
