from pipetrace.cli import main

raise SystemExit(main())
