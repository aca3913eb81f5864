from grpo_cli.main import main

raise SystemExit(main())
