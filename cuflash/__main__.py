"""`python -m cuflash ...`: the same command line as the `cuflash` script."""
from .cli import main

main()
