"""`python -m autoragged.report`: see autoragged/report/__init__.py."""

from . import main

raise SystemExit(main())
