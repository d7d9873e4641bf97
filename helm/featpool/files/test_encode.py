# `helm test`: encode one small generated image through the Service, check the answer, delete the
# lease. Runs in the featpool image (Python, Pillow); tests/test_helm_hook.py runs this very file
# against a real server.
import io
import json
import os
import urllib.request

from PIL import Image

url = os.environ["FEATPOOL_URL"].rstrip("/")
headers = {"Content-Type": "image/png"}
if os.environ.get("FEATPOOL_API_KEY"):
    headers["Authorization"] = "Bearer " + os.environ["FEATPOOL_API_KEY"]

png = io.BytesIO()
Image.new("RGB", (64, 48), (200, 60, 20)).save(png, "PNG")
request = urllib.request.Request(url + "/v1/encode", png.getvalue(), headers, method="POST")
with urllib.request.urlopen(request, timeout=120) as r:
    items = json.load(r)["items"]
assert len(items) == 1, items
lease = items[0]
assert lease["nbytes"] > 0 and lease["shape"], lease
print(f"encoded: shape {lease['shape']} {lease['dtype']} via {lease['transport']}")
lease_url = url + "/v1/leases/" + lease["lease_id"]
delete = urllib.request.Request(lease_url, None, headers, method="DELETE")
with urllib.request.urlopen(delete, timeout=30) as r:
    assert r.status in (200, 204), r.status
print("lease released")
