import sys

from router.cli.main import main

sys.exit(main())
