"""The ground floor: plain data and small utilities that every layer shares (a request's processed inputs, the
scheduler -> runner step contract, request outputs, stop matching, host -> device copies). Imports nothing else of
mmserve, so any layer may import it."""
