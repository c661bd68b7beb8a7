import sys

from jspec.serve.cli import main

sys.exit(main())
