"""The `specrack` subcommands, one module each: `add_parser(sub)` declares the command's options
(and sets `fn`, the function that runs it), `experiments.cli` lists them in order."""
