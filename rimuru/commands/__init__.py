"""One module per `rimuru` subcommand (see rimuru.cli.COMMANDS)."""
