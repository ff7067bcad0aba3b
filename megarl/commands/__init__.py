"""One module per `megarl` subcommand; each defines `register(subparsers)` setting `func`."""
