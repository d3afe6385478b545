"""Studies without the weights: synthetic routing traces and their fit, parameter sweeps over the
simulators (process pool or Ray), and the sweeps' figures."""
