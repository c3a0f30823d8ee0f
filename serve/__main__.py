"""`python -m serve`: the `serve` command, whatever else claims that script name (Ray
Serve's CLI is also called `serve`, and a later install of ray overwrites the script)."""

from serve.api.cli import main

main()
