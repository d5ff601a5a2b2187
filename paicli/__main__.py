"""`python -m paicli` is `pai`."""

from paicli.pai import main

main()
