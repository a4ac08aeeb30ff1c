from dflashpipe.cli import main

raise SystemExit(main())
