import sys

from gpulab.memory.cli import main

sys.exit(main())
