"""`python -m rollstream ...`: the same command line as the `rollstream` script."""

from rollstream.app.cli import main

main()
