"""Routes: v1_file (being written)."""

from fastapi import APIRouter

router = APIRouter()
