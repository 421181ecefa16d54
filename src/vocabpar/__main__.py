from vocabpar.cli import main

raise SystemExit(main())
