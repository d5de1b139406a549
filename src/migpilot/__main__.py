"""Allows ``python -m migpilot``, the same as the ``migpilot`` console command."""

from migpilot.cli import main

if __name__ == "__main__":
    main.entrypoint()
