import sys

from splitserve.cli.commands import main

sys.exit(main())
