"""``python -m stof_tvm`` runs the command line."""
import sys

from stof_tvm.cli import main

sys.exit(main())
