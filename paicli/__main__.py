"""`python -m paicli` is `pai`."""

from paicli.cli import main

main()
