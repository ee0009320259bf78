import sys

from dmtd.cli import main

sys.exit(main())
