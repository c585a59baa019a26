"""``python -m quant_recipes.cli``: the ``quant`` command."""

import sys

from . import main

sys.exit(main())
