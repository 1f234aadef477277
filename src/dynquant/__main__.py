import sys

from dynquant.cli import main

sys.exit(main())
