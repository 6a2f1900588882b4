import sys

from llmnote.grading.batch import main

sys.exit(main())
