import os
from pathlib import Path

here = Path(__file__).resolve().parent
print(os.pathsep.join([str(here), str(here.parents[2])]))
