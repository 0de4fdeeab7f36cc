"""nebula_cli: the `nebula` command line over the public nebulaml API (rendering only)."""
