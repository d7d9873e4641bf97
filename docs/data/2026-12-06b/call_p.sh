#!/bin/bash
# Does CPU contention slow nvJPEG's call? The probe, then efe against "pin" (the prepare thread
# alone on CPU 0; the server's other threads, the fronts and the load generator on the CPUs
# other than CPU 0's core), interleaved through call_a.sh.
D=$(dirname "$0")
lscpu | grep -E "Model name|Thread|Core|Socket|MHz"
python3 "$D/probe_contention.py" 2>&1 | tail -11
export OTHERS=$(python3 "$D/probe_contention.py" --others)
echo "others: $OTHERS"
ORDER=${ORDER:-efe pin efe pin} bash "$D/call_a.sh"
