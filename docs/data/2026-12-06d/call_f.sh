#!/bin/bash
# For the next device call (not run this session): where the service's prepare call loses
# ~23 us an image against a bare process. The prepare call beside the forward and beside one or
# two threads holding the interpreter lock (probe_ceiling.py PART=spin), then the sweep's 16x64
# point with --prepare-threads 2 against 1 (default), interleaved; into $OUT/all.tgz.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
PART=spin python3 docs/data/2026-12-06d/probe_ceiling.py > $O/probe-spin.txt 2>&1; echo "probe rc=$?"; grep "together" $O/probe-spin.txt
OUT=$O ORDER="head head+2 head head+2" POINTS=mp:16x64 LIMIT=420 bash $A/call_a.sh 2>&1 | grep -E "^row|featpool|Error"
cd $O && tar czf all.tgz probe-spin.txt *.json *.log 2>/dev/null; date -u
