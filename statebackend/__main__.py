"""``python -m statebackend``: the ``statebackend`` command."""

from statebackend.cli import main

raise SystemExit(main())
