"""``python -m ckptkeeper``: the same as the ``ckptkeeper`` command."""

from .cli import main

raise SystemExit(main())
