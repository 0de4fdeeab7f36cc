"""One module per `nebula` command: parse options, call nebulaml, render. No logic."""
