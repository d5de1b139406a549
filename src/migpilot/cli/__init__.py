"""The ``migpilot`` command line: a thin shell that parses arguments, calls the core, prints.

Each command lives in its own module with a ``register(subparsers)`` function; ``main`` wires
them together and turns every :class:`migpilot.errors.MigpilotError` into a one-line message
and exit code 2.
"""
