"""What the ``statebackend`` command does, as functions over checkpoint storage.

Between ``checkpoint/`` and ``cli.py``: each module here reads (and for ``gc`` deletes)
checkpoints and returns plain data; ``cli.py`` only parses arguments and prints.
"""
