from benchmarks.large_batch.cli import main

raise SystemExit(main())
