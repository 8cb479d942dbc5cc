"""gcp-storage-emulator with two behaviours of Cloud Storage that it lacks and that the clients under test rely on;
run as ``python tests/gcs_emulator.py start --host=... --port=...`` (the emulator's own command line).

- A download (``alt=media``) carries the object's generation in ``x-goog-generation`` (and ``x-goog-metageneration``):
  TensorStore's ``gcs`` driver reads the generation from there, and without it takes 0, so its next conditional
  write (OCDBT's manifest, under every Orbax checkpoint) fails with "Malformed StorageGeneration".
- An upload with ``ifGenerationMatch`` (0: only if absent) is refused with 412 when the object's generation differs,
  as Cloud Storage does: TensorStore's OCDBT commits and jaxtrain's workdir lease depend on it.

Both are patched into the emulator's handlers before its server module builds its routing table from them.
"""

from __future__ import annotations

import sys
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download, _insert = objects.download, objects.insert


def _generation(storage, bucket: str, name: str) -> str:
  try:
    return str(storage.get_file_obj(bucket, name)["generation"])
  except NotFound:
    return "0"


def download(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
  except NotFound:
    obj = None
  if obj is not None:
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
  return _download(request, response, storage, *args, **kwargs)


def insert(request, response, storage, *args, **kwargs):
  wanted = request.query.get("ifGenerationMatch")
  if wanted and "upload_id" not in request.query:
    name = request.query["name"][0] if "name" in request.query else None
    if name is None and isinstance(request.data, dict):
      name = (request.data.get("meta") or {}).get("name") or request.data.get("name")
    if name is not None and _generation(storage, request.params["bucket_name"], name) != wanted[0]:
      response.status = HTTPStatus.PRECONDITION_FAILED
      response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you specified did not "
                                                       "hold."}})
      return None
  return _insert(request, response, storage, *args, **kwargs)


objects.download, objects.insert = download, insert

if __name__ == "__main__":
  from gcp_storage_emulator.__main__ import main
  main(sys.argv[1:])
