"""Every test sees 8 simulated CPU devices, patient with a machine busy compiling."""

import redcoast as rc

rc.simulate_devices(8)
