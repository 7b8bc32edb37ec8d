"""What the ``statebackend`` command does, as functions over checkpoint storage.

Between ``checkpoint/`` and ``cli/``: each module here reads (and for ``gc`` deletes)
checkpoints and returns plain data; ``cli/`` only parses arguments and prints.
"""
