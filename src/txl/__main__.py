import sys

from txl.cli import main

sys.exit(main())
