"""`python -m transom` is the `transom` command."""

from transom.cli import main

raise SystemExit(main())
