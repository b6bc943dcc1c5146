"""Data-parallel mmserve replicas on Ray Serve (`mmserve serve --data-parallel-size N`): launch.py deploys, ingress.py
fronts, replica.py serves, router.py routes by picture and prompt prefix. Needs `pip install mmserve[ray]`."""
