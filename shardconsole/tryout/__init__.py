"""Trying a run's parts by hand: its data as the model will see it (preview.py) and a chat with the
model it trained (chat.py). Tools with torch and transformers, below the command line, beside no UI."""
