import sys

from fxpipe.cli import main

sys.exit(main())
