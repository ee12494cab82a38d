"""Stage 5 of the analysis: the memory peak buffer by buffer, how it scales across a sweep,
and whether the step fits a chip."""

from ._fit import fit_of as fit_of
from ._fit import hbm_gib as hbm_gib
from ._frames import helper_frames as helper_frames
from ._peak import peak_buffers as peak_buffers
from ._peak import peak_lines as peak_lines
from ._peak import unsourced as unsourced
from ._scaling import memory_scaling as memory_scaling
from ._scaling import MemoryScaling as MemoryScaling
