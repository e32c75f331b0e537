"""What the `packedenc` command's subcommands do beyond parsing (`packedenc/cli.py` parses and
dispatches): writing outputs (`output.py`) and the sharded, resumable embed (`shards.py`)."""
