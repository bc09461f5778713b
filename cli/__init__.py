"""The `fanout` command: its parser and entry point (main.py), what each command does
(commands.py), its flags made from their one definition (flags.py), `fanout up`'s processes
(up.py) and the embedded Redis it starts when none is given (redis_server.py)."""
