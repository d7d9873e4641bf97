#!/bin/bash
# Twenty-fifth session, for the next device call: the arenas' tensors held (app.gpu_decode.held)
# against the same tree without the hold, at sixteen per request, c=64, interleaved, one server
# per row (head: this tree; nohold: a copy with held() returning the tensor itself, the control
# of tests/test_job_arena.py; norm: a copy with normalise-in-call.diff, the normalisation inside
# the one call). The naive baseline in the first row unless NONAIVE=1. Then the GPU tests that
# run the arena's spans and the one call, on this tree and on norm's (TESTS=... to change
# them). Into $OUT/all.tgz.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
rm -rf /tmp/nohold && mkdir /tmp/nohold && tar --exclude=./.git --exclude=./.whl --exclude=./.whl-extra --exclude=./scratch -cf - . | tar -xf - -C /tmp/nohold
sed -i 's/    return Held(t, t\[:\])/    return Held(t, t)/' /tmp/nohold/app/gpu_decode.py && grep -q "return Held(t, t)$" /tmp/nohold/app/gpu_decode.py && echo "nohold tree ready"
rm -rf /tmp/norm && cp -r /tmp/nohold /tmp/norm && cp app/gpu_decode.py /tmp/norm/app/ && (cd /tmp/norm && git apply docs/data/2026-12-07b/normalise-in-call.diff) && echo "norm tree ready"
START=$SECONDS; i=0
for row in ${ORDER:-head nohold norm head nohold norm}; do
  i=$((i+1))
  [ $((SECONDS-START)) -gt ${LIMIT:-300} ] && { echo "stop before row $i ($row): time"; break; }
  if [ $i -eq 1 ] && [ -z "$NONAIVE" ]; then bl=(--baseline-points raw:1x16 "--baseline-args=$NA"); else bl=(--baseline-points=); fi
  t0=$SECONDS; mkdir -p $O/logs-$i-$row
  python3 bench/bench_e2e.py $B --points mp:16x64 "${bl[@]}" --server-root $(case $row in nohold) echo /tmp/nohold;; norm) echo /tmp/norm;; *) echo $PWD;; esac) "--featpool-args=$FA $BIG" --logs $O/logs-$i-$row --out $O/e2e-$i-$row.json > $O/e2e-$i-$row.log 2>&1
  echo "row $i $row rc=$? $((SECONDS-t0)) s"
  python3 $A/rows.py $O/e2e-$i-$row.json
done
T="${TESTS:-tests/test_job_arena.py tests/test_imaging.py tests/test_decoder_choice.py tests/gpu/test_job_arena_gpu.py tests/gpu/test_pipeline_gpu.py tests/gpu/test_torchcodec_gpu.py tests/gpu/test_nvimgcodec_gpu.py}"
python3 -m pytest -q -p no:cacheprovider $T > $O/gputests.txt 2>&1; echo "tests (head) rc=$?"; tail -3 $O/gputests.txt
(cd /tmp/norm && python3 -m pytest -q -p no:cacheprovider $T) > $O/gputests-norm.txt 2>&1; echo "tests (norm) rc=$?"; tail -3 $O/gputests-norm.txt
cd $O && tar czf all.tgz *.json *.log gputests*.txt; date -u
