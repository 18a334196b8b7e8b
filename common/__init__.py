"""What the host (builder/, devenv/) and the image (trainbox/) share: the atomic writer, redaction, the launch
planner, the command table and the in-image error type. Ships in every image beside trainbox/
(/opt/trainbox/common); imports the standard library and itself only, so importing it on the host loads nothing of
the image's side (tests/test_layout.py). Nothing runs here.
"""
