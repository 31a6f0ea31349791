from pisft.cli import main

raise SystemExit(main())
