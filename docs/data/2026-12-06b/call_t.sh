#!/bin/bash
# The whole GPU suite (or TESTS) of the tree it is run in, into $OUT/gputests.txt.
source "$(dirname "$0")/common.sh"
git log --oneline -1 2>/dev/null
t0=$SECONDS
python3 -m pytest -q -p no:cacheprovider -rA --timeout=150 ${TESTS:-tests/gpu tests/test_cuda_vmm_fake.py tests/test_handoff.py tests/test_discovery.py} > $OUT/gputests.txt 2>&1
echo "pytest rc=$? $((SECONDS-t0)) s"; grep -E "passed|failed|error" $OUT/gputests.txt | tail -3; grep -E "^(FAILED|ERROR|SKIPPED)" $OUT/gputests.txt | head -20
date -u
