"""Every Python process the tests start (with this folder on PYTHONPATH) gets the fault seam's hooks
when a KILN_FAULT_* variable asks for a fault; see kiln_faults.py."""

import os

if any(name.startswith("KILN_FAULT_") for name in os.environ):
    import kiln_faults

    kiln_faults.install_all()
