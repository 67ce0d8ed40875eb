from cerar.cli import main

raise SystemExit(main())
