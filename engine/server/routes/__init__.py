"""The engine server's routes, one APIRouter per group; create_app (app.py) includes them."""
